-- Saga leases (saga.py): which process ran each step of a saga, so that the checker can tell a saga run
-- by two processes at once (no_saga_run_twice). NULL for steps logged before leases.
ALTER TABLE saga_events ADD COLUMN owner text;
