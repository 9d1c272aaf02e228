-- The fleet's totals are derived from the silos' (queries.sql, fleet_get): a row of its own would be one
-- lock that every charge in the fleet takes, so that charges of different silos could never apply side by
-- side. Each silo's total is bounded instead (MAX_TOTAL), so no sum of them overflows what it is read as.
DROP TABLE fleet;
