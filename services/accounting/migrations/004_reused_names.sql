-- A silo or project deleted in instance-manager (`silo delete`, `project delete`) keeps its row here: a
-- late delta about one of its instances still finds it, and its usage history stays readable. Its name
-- may then be given to a new one, with another id: `seq` orders the rows of one name as their creations
-- arrived (one consumer, in stream order), and a name means its newest row.
ALTER TABLE silos ADD COLUMN seq bigserial;
ALTER TABLE projects ADD COLUMN seq bigserial;
