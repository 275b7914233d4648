"""cli: the `flywheel` command line. It may import every package; nothing imports it.

- `cli.main.main`: the error boundary (every failure one line, exit code 2); `cli.parser`:
  every subcommand and its flags;
- the commands by kind: `cli.launch` (run, serve, deploy, worker), `cli.inspection` (status,
  lineage, library, strategies, report), `cli.admin` (the model server, the gateway, promotion,
  the sandbox, migrations, models) and `cli.export`;
- `cli.flags` makes `flywheel run`'s flags from `flows.settings.RunSettings`' fields, and
  `cli.arguments` holds what the commands share (the database URL, keys, model folders, ports).

Imports are deliberately not re-exported here, so `flywheel --help` stays fast.
"""
