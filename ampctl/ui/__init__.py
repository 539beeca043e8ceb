"""Display: the live table, plain lines, the sinks beside the run folder, the run's picture."""
