"""Results store, typed records, tables, plots and the HTML report.

Nothing here knows model internals or the harness that produced the records: report
modules import only `records`, `policies` (to ask a recorded policy what it declares)
and `eval` (to aggregate trial records), never `ab` or `cli`.
"""
