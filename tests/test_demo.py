from kvevict.demo import DemoRow, format_table


def test_table_shows_bytes_share_and_correctness() -> None:
    rows = [
        DemoRow("full", None, 100 * 2**20, "8056020.", True, 5.0),
        DemoRow("snapkv", 256, 25 * 2**20, "8056", False, 4.0),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["policy", "budget", "retained", "KV", "%", "full", "answer", "correct?", "s"]
    assert lines[2].split() == ["full", "all", "100.00", "MiB", "100%", "8056020.", "yes", "5.0"]
    assert lines[3].split() == ["snapkv", "256", "25.00", "MiB", "25%", "8056", "no", "4.0"]
