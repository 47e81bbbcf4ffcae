"""What a run writes and reads back: the typed lines of `results.jsonl` (`schema`) and the append-only store
(`store`). A floor below the harness (`ab/`) and the report (`report/`): neither of those is imported here."""
