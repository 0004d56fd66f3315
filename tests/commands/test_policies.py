"""``kvevict policies`` (kvevict.commands.policies): every registered policy and prefix, with its summary."""

import kvevict
from kvevict.cli import main


def test_policies_lists_name_and_summary(capsys) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prefixes = [f"{prefix}+<policy>" for prefix in kvevict.policies.PREFIXES]
    assert [line.split()[0] for line in lines] == kvevict.list_policies() + prefixes
    assert all(len(line.split()) > 2 for line in lines)
