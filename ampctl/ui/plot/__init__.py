"""A run folder's picture (``plot.png``): read for drawing (:mod:`.run_data`, reduced to the
figure's resolution by :mod:`.decimate`) and drawn (:mod:`.run_figure`) on matplotlib's Agg
canvas, imported lazily. What ``ampctl plot`` draws of a run (:mod:`ampctl.commands.plot`), and
what every run draws at its end (:func:`.run_figure.maybe_plot_run`, from
:meth:`ampctl.protect.shell.RunShell.plot`). No device reads."""
