"""The statistics every compared figure rests on: intervals (`uncertainty`), the tolerance rule and its paired
judgements (`tolerance`, `paired_ratio`), and `judge`, the one call that judges a candidate against its reference.
A floor below the harness (`ab/`, whose searches judge their probes) and the report: neither is imported here."""
