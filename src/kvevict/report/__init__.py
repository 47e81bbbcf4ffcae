"""Results store, tables, plots and the HTML report: nothing here knows model internals."""
