"""What each command does, one module (or package) each: load config -> build -> run -> close.

The CLI (:mod:`ampctl.cli`) parses options and calls these; they raise the input errors that the
CLI turns into exit code 2.
"""
