-- Tag caps per owner. A tag is a team's own word: one team's jobs tagged `reports` must not hold the
-- slots of another team's `tag:reports` cap. A tag cap now names its owner (that owner's jobs with
-- the tag), or '' for a fleet-wide cap over every owner's jobs with the tag, which the operator asks
-- for explicitly (`chimes cap set tag:NAME N --fleet-wide`). Caps made before this migration were
-- fleet-wide, and stay so. Owner caps (scope 'owner') name the owner in `name`; their `owner` is ''.
ALTER TABLE concurrency_caps ADD COLUMN owner text NOT NULL DEFAULT '';
ALTER TABLE concurrency_caps DROP CONSTRAINT concurrency_caps_pkey;
ALTER TABLE concurrency_caps ADD PRIMARY KEY (scope, name, owner);
ALTER TABLE concurrency_caps ADD CONSTRAINT concurrency_caps_owner_of_tag CHECK (scope = 'tag' OR owner = '');
