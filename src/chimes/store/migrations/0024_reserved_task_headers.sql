-- An HTTP task's X-Chimes-* headers were accepted and never sent: the worker sends its own in their
-- place (the run's identity, signature and lease token). The API now refuses them (422), and a
-- change to a job validates its whole stored definition: a job written before, with such a header,
-- could not be changed at all, not even to remove it. They are removed from the stored tasks, plain
-- and secret; what the job sends is the same, so neither its version nor its triggers change.
UPDATE jobs j
SET task = j.task
    || CASE WHEN jsonb_typeof(j.task -> 'headers') = 'object' THEN jsonb_build_object('headers',
           (SELECT coalesce(jsonb_object_agg(h.key, h.value), '{}') FROM jsonb_each(j.task -> 'headers') h
            WHERE lower(h.key) NOT LIKE 'x-chimes-%')) ELSE '{}' END
    || CASE WHEN jsonb_typeof(j.task -> 'secretHeaders') = 'object' THEN jsonb_build_object('secretHeaders',
           (SELECT coalesce(jsonb_object_agg(h.key, h.value), '{}') FROM jsonb_each(j.task -> 'secretHeaders') h
            WHERE lower(h.key) NOT LIKE 'x-chimes-%')) ELSE '{}' END
WHERE EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(j.task -> 'headers') = 'object'
                                                   THEN j.task -> 'headers' ELSE '{}' END) k
              WHERE lower(k) LIKE 'x-chimes-%')
   OR EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(j.task -> 'secretHeaders') = 'object'
                                                   THEN j.task -> 'secretHeaders' ELSE '{}' END) k
              WHERE lower(k) LIKE 'x-chimes-%');
