"""``kvevict policies`` (kvevict.commands.policies): every registered policy and prefix, with its summary."""

import kvevict
from kvevict.cli import main


def test_policies_lists_name_and_summary(capsys) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prefixes = [f"{prefix}+<policy>" for prefix in kvevict.policies.PREFIXES]
    assert [line.split()[0] for line in lines] == kvevict.list_policies() + prefixes
    assert all(len(line.split()) > 2 for line in lines)


def test_policies_gives_kvpress_s_name_beside_ours() -> None:
    listed = {name for name, _ in kvevict.describe_policies()}
    assert set(kvevict.policies.KVPRESS) <= listed  # every kvpress name belongs to a policy we list


def test_a_policy_kvpress_also_has_shows_its_name(capsys) -> None:
    main(["policies"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["keydiff"].endswith("(kvpress: KeyDiffPress)")
    assert lines["critical+<policy>"].endswith("(kvpress: CriticalKVPress)")
    assert "kvpress" not in lines["h2o"]
