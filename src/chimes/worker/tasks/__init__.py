"""Task execution: one module per task type (:mod:`.http`, :mod:`.command`, :mod:`.container`), what
they share (:mod:`.common`, and :mod:`.processes` for the two that run local processes), and the
dispatcher the worker loop talks to (:mod:`.dispatch`). Imports point one way only:
dispatch → the task types → processes → common.
"""
