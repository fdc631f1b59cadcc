-- A calendar's `version` counts that calendar's own writes (each write adds one); it was a number
-- from one sequence for the whole fleet, which let a team count other teams' writes. Scheduler nodes
-- still need to see any write at once: `change` takes the next number of that sequence on every
-- insert and update, whatever statement wrote the row (a process of the release before this one
-- writes calendars without it), and nodes compare the sum of the changes and the count with what
-- they hold (chimes.scheduler.calendar_book). An expand step: existing calendars keep their version, and the
-- release before never reads `change`.
ALTER TABLE calendars ADD COLUMN change bigint;
UPDATE calendars SET change = version;
ALTER TABLE calendars ALTER COLUMN change SET NOT NULL;
CREATE INDEX calendars_change ON calendars (change);

CREATE FUNCTION chimes_calendar_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.change := nextval('calendar_versions');
    RETURN NEW;
END;
$$;

CREATE TRIGGER calendars_change BEFORE INSERT OR UPDATE ON calendars
FOR EACH ROW EXECUTE FUNCTION chimes_calendar_changed();
