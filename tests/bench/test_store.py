from kvevict.bench.store import ResultStore, record_key


def record(index: int, policy: str = "h2o", budget: int | None = 64) -> dict:
    return {
        "task": "vt",
        "index": index,
        "length": 512,
        "seed": 0,
        "model": "m",
        "policy": policy,
        "policy_params": {},
        "budget": budget,
        "keep": None,
        "interval": 1,
        "query_aware": False,
        "max_new_tokens": 30,
        "score": 1.0,
    }


def test_appends_and_reloads(tmp_path) -> None:
    store = ResultStore(tmp_path / "run")
    store.append(record(0))
    store.append(record(1))
    again = ResultStore(tmp_path / "run")
    assert len(again) == 2 and record(1) in again and record(2) not in again
    assert [item["index"] for item in again] == [0, 1]
    assert again.get(record(0))["score"] == 1.0


def test_key_is_the_whole_configuration() -> None:
    assert record_key(record(0)) != record_key(record(0, budget=128))
    assert record_key(record(0)) != record_key(record(0, policy="tova"))
    assert record_key({**record(0), "score": 0.0, "decode_s": 3.0}) == record_key(record(0))


def test_a_torn_last_line_is_cut_and_nothing_finished_is_lost(tmp_path) -> None:
    store = ResultStore(tmp_path)
    store.append(record(0))
    with store.path.open("a") as out:
        out.write('{"task": "vt", "index": 1, "len')  # the process died mid-write
    again = ResultStore(tmp_path)
    assert len(again) == 1
    again.append(record(1))
    assert [item["index"] for item in ResultStore(tmp_path)] == [0, 1]
