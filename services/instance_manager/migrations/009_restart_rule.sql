-- When a failed instance's next automatic restart is due, or NULL if none will be: the one rule, read by
-- instance_view (what recovery decides on) and by the start interlock (what an automatic restart must
-- pass, by this service's own clock). Only a failed best_effort instance meant to run is restarted; the
-- first restart is due at once, each later one a cooldown after the last, doubled for each restart in a
-- row that could not start the instance (restart_failures), up to the longest wait.
CREATE FUNCTION next_restart_at(i instances, cooldown float8, backoff_max float8) RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN i.state = 'failed' AND i.auto_restart = 'best_effort' AND i.intended_state = 'running'
        THEN greatest(i.failed_at, i.last_auto_restart_at
                      + make_interval(secs => least(cooldown * 2 ^ least(i.restart_failures, 30),
                                                    greatest(cooldown, backoff_max))))
    END
$$;
