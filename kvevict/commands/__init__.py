"""The ``kvevict`` commands, one module each.

A command module has two parts: ``add_parser(commands)`` adds its subparser to the top-level
``kvevict`` parser and sets, with ``set_defaults``, the handler ``run(args) -> int`` (the exit
status) and the ``extra`` the handler needs (``None``: the core install suffices). Adding a
command is one new module here and one entry in :data:`kvevict.cli.COMMANDS`. Options shared
by several commands and the guard every handler runs under are in :mod:`kvevict.commands.common`.
A module imports what its handler needs inside the handler, so building the parser stays cheap
and a command whose extra is missing is refused by the guard, never by an ``ImportError``.
"""
