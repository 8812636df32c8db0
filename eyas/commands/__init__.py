"""eyas.commands: one module per subcommand (HELP, add_arguments, main)."""


def flag_overrides(args, section: str, *names: str) -> list[str]:
    """`--set`-style overrides `section.name=value` for each command-line flag `name` that was given
    (a flag's dest and its config key share the name)."""
    return [f"{section}.{name}={getattr(args, name)}" for name in names if getattr(args, name) is not None]
