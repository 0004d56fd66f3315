"""Training Fast KVzip's gates (kvevict.gates.train) on a tiny model: KVzip's scores as
targets, a lower distillation loss on held-out contexts, determinism and resumption."""

from __future__ import annotations

import re

import pytest
import torch

from kvevict.gates import hook_attention_inputs, initial_gates, shape_of
from kvevict.gates.losses import distillation_loss
from kvevict.gates.train import (
    RecordingKVzip,
    TrainConfig,
    answer_scores,
    collect,
    contexts,
    recorded,
    taught,
    top_positions,
    train,
    varied_contexts,
)
from tests.conftest import prompt, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:kvzip. no tokenizer")  # tiny models: the bare-context repeat


@pytest.fixture(scope="module")
def data():
    """Features and KVzip targets of six 64-token contexts of the tiny model (32 positions each)."""
    model = tiny_model()
    positions = torch.arange(4, 64, 2)
    found = [collect(model, prompt(64, seed=seed), positions) for seed in range(6)]
    features, targets = zip(*found)
    return model.config, torch.cat(features[:5], 1), torch.cat(targets[:5], 2), features[5], targets[5]


def test_the_targets_are_kvzip_scores_per_layer_head_and_token(data) -> None:
    config, features, targets, _, _ = data
    assert features.shape == (config.num_hidden_layers, 5 * 30, config.hidden_size)
    assert targets.shape == (config.num_hidden_layers, config.num_key_value_heads, 5 * 30)
    assert bool(((targets >= 0) & (targets <= 1)).all()) and float(targets.max()) > 0


def test_the_targets_are_fp32_kvzip_scores_whether_or_not_the_cpu_multiplies_bf16(monkeypatch) -> None:
    """kvzip's default (``auto``) repeats in bf16 where bf16 is multiplied in hardware; the targets
    never do, so the shipped gates are reproduced on any CPU."""
    model, ids, positions = tiny_model(), prompt(64, seed=2), torch.arange(4, 64, 3)
    found = []
    for native in (True, False):
        monkeypatch.setattr("kvevict.policies.kvzip.multiplies_bf16_natively", lambda device, native=native: native)
        found.append(collect(model, ids, positions)[1])
    assert torch.equal(*found)


def test_kvzip_plus_targets_weigh_each_entry_by_its_projected_value_over_the_residual_norm() -> None:
    """``teacher="kvzip+"``: the targets are ``kvzip[plus=true]``'s scores. With one repeat query per
    context token, an entry's score is its largest weighted probability; scaling every value by ``c`` scales
    ``‖W_O v‖`` by ``c`` and leaves the first layer's attention (and ``‖h‖``) as it was, so its targets scale by
    ``c`` where kvzip's own do not move."""
    model, ids, positions = tiny_model(), prompt(48, seed=3), torch.arange(4, 48, 2)
    plain, plus = collect(model, ids, positions)[1], collect(model, ids, positions, plus=True)[1]
    assert not torch.allclose(plain, plus)
    for layer in model.model.layers:
        layer.self_attn.v_proj.weight.data *= 2.0
    assert torch.equal(collect(model, ids, positions)[1][0], plain[0])
    torch.testing.assert_close(collect(model, ids, positions, plus=True)[1][0], 2 * plus[0], rtol=1e-4, atol=1e-7)


def test_training_lowers_the_distillation_loss_on_held_out_contexts(data) -> None:
    config, features, targets, held_features, held_targets = data
    run = TrainConfig(model="tiny", steps=80, batch=64, lr=1e-2)
    gates = train(features, targets, run, shape_of(config), progress=False)
    before = distillation_loss(initial_gates(shape_of(config), run.seed), held_features, held_targets)
    after = distillation_loss(gates, held_features, held_targets)
    assert float(after) < 0.9 * float(before)


def test_training_is_deterministic_and_resumes_to_the_same_gates(data, tmp_path) -> None:
    config, features, targets, _, _ = data
    run = TrainConfig(model="tiny", steps=60, batch=64, lr=1e-2)
    whole = train(features, targets, run, shape_of(config), progress=False)
    again = train(features, targets, run, shape_of(config), progress=False)
    checkpoint = tmp_path / "checkpoint.pt"
    train(
        features, targets, TrainConfig(model="tiny", steps=50, batch=64, lr=1e-2), shape_of(config), checkpoint, False
    )
    resumed = train(features, targets, run, shape_of(config), checkpoint, progress=False)
    for mine, twin, rest in zip(whole, again, resumed):
        assert all(torch.equal(mine[part], twin[part]) and torch.equal(mine[part], rest[part]) for part in mine)


def test_several_lengths_are_taken_in_turn_by_the_pairs_of_contexts(tokenizer, tmp_path) -> None:
    """An essay window and a task's context share a length; each round of the six tasks shifts the
    lengths by one; a single length draws the contexts it always drew."""
    config = TrainConfig(model="smollm2", count=16, length=(64, 96))
    mixed = contexts(tokenizer, config, [])
    wanted = [64, 64, 96, 96] * 3 + [96, 96, 64, 64]
    assert [piece.shape[-1] for piece in mixed[::2]] == wanted[::2]  # essay windows: exactly the length
    assert all(length // 2 < piece.shape[-1] <= length for piece, length in zip(mixed[1::2], wanted[1::2]))
    single = contexts(tokenizer, TrainConfig(model="smollm2", count=2, length=(64,)), [])
    assert torch.equal(mixed[0], single[0]) and torch.equal(mixed[1], single[1])  # the first pair: the first length
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{index}" for index in range(400)), encoding="utf-8")
    pieces = contexts(tokenizer, TrainConfig(model="smollm2", count=3, length=(64, 96)), [text])
    assert [piece.shape[-1] for piece in pieces] == [64, 64, 96]
    assert torch.equal(
        torch.cat(pieces, -1)[0], torch.tensor(tokenizer.encode(text.read_text(), add_special_tokens=False)[:224])
    )


def test_varied_contexts_draw_needle_families_every_fourth_a_haystack_alone(tokenizer) -> None:
    from kvevict.bench.needles import NOUNS

    config = TrainConfig(model="smollm2", count=8, length=(64, 96), data="varied")
    pieces = contexts(tokenizer, config, [])
    assert all(piece.shape[-1] <= length for piece, length in zip(pieces, [64, 64, 96, 96] * 2))
    texts = [tokenizer.decode(piece[0]) for piece in pieces]
    hidden = [any(f"{noun}s are hidden" in text for noun in NOUNS.values()) for text in texts]
    assert hidden == [True, True, True, False] * 2
    again = contexts(tokenizer, config, [])
    assert all(torch.equal(a, b) for a, b in zip(pieces, again))  # drawn with the seed
    assert recorded(config)["data"] == "varied" and "data" not in recorded(TrainConfig(model="smollm2"))


def test_phrased_contexts_are_varied_ones_in_other_phrasings_drawn_with_the_seed(tokenizer) -> None:
    config = TrainConfig(model="smollm2", count=4, length=(256,), data="phrased", teacher="answers")
    drawn = varied_contexts(tokenizer, config)
    again = varied_contexts(tokenizer, config)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(drawn, again))
    assert [len(readings) > 0 for _, readings in drawn] == [True, True, True, False]
    varied = varied_contexts(tokenizer, TrainConfig(model="smollm2", count=4, length=(256,), data="varied"))
    assert not any(torch.equal(a, b) for (a, _), (b, _) in zip(drawn, varied))
    assert recorded(config)["data"] == "phrased"


def test_contexts_phrased_in_both_orders_are_drawn_with_the_seed_from_their_own_space(tokenizer) -> None:
    from kvevict.bench.needles import SPACES
    from kvevict.gates.train import NEEDLED

    assert NEEDLED == tuple(SPACES)
    config = TrainConfig(model="smollm2", count=4, length=(256,), data="phrased-both-orders", teacher="answers")
    drawn = varied_contexts(tokenizer, config)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(drawn, varied_contexts(tokenizer, config)))
    phrased = varied_contexts(tokenizer, TrainConfig(model="smollm2", count=4, length=(256,), data="phrased"))
    assert not any(torch.equal(a, b) for (a, _), (b, _) in zip(drawn, phrased))
    assert recorded(config)["data"] == "phrased-both-orders"


def test_dense_contexts_add_six_and_eight_keys_to_the_phrased_shapes(tokenizer) -> None:
    from kvevict.bench.needles import PHRASED, PHRASED_DENSE

    assert PHRASED_DENSE.shapes == (*PHRASED.shapes, (6, 1), (8, 1))
    assert PHRASED_DENSE.phrasings == PHRASED.phrasings and PHRASED_DENSE.haystacks == PHRASED.haystacks
    config = TrainConfig(model="smollm2", count=16, length=(1024,), data="phrased-dense", teacher="answers")
    readings = [len(read) for _, read in varied_contexts(tokenizer, config)]
    assert max(readings) >= 6 and readings[3::4] == [0, 0, 0, 0]  # every fourth context a haystack alone


def test_each_needle_context_carries_every_keys_question_and_answer_to_read(tokenizer) -> None:
    """``--teacher answers`` reads, after each needle context, every key's question, answer prefix and values;
    a haystack alone has nothing to read, and a key whose needle was cut off with the context's end is not asked."""
    config = TrainConfig(model="smollm2", count=8, length=(256,), data="varied", teacher="answers")
    drawn = varied_contexts(tokenizer, config)
    assert [len(readings) for _, readings in drawn] == [2, 1, 2, 0, 2, 1, 4, 0]  # context 5 lost one of its 2 keys
    assert all(torch.equal(ids, plain) for (ids, _), plain in zip(drawn, contexts(tokenizer, config, [])))
    for ids, readings in drawn:
        context = tokenizer.decode(ids[0])
        for reading in readings:
            text = tokenizer.decode(reading[0])
            key = text.split(" for ")[1].split(" in the text above?")[0]
            values = text.rsplit(":", 1)[1].strip(" .").split(", ")
            assert text.count(key) == 2 and all(value in context for value in values)
            assert sum(context.count(value) for value in values) == len(values)  # each value once, in the context


def test_answer_scores_are_kvzip_plus_scores_with_the_readings_as_the_repeat() -> None:
    """Given KVzip's own repeat chunks as the readings, the answers' targets are KVzip+'s; another reading
    scores the same entries otherwise."""
    model, ids, positions = tiny_model(), prompt(64, seed=5), torch.arange(4, 64, 2)
    repeat = RecordingKVzip().repeat_inputs(model, ids)
    assert torch.equal(answer_scores(model, ids, positions, repeat), collect(model, ids, positions, plus=True)[1])
    other = answer_scores(model, ids, positions, [ids[:, 10:30]])
    assert other.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads, len(positions))
    assert not torch.equal(other, collect(model, ids, positions, plus=True)[1])


def test_the_teachers_targets_from_a_contexts_saved_scores() -> None:
    nan = float("nan")
    saved = {"targets": torch.tensor([[0.2, 0.5, nan]]), "answers": torch.tensor([[0.4, 0.1, nan]])}
    exactly = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(taught("kvzip+", saved), saved["targets"], **exactly)
    torch.testing.assert_close(taught("answers", saved), saved["answers"], **exactly)
    torch.testing.assert_close(taught("kvzip+answers", saved), torch.tensor([[0.4, 0.5, nan]]), **exactly)


@pytest.mark.parametrize("options", [{"data": "ruler"}, {"data": "varied", "top": 8}])
def test_an_answers_teacher_needs_varied_data_without_top(options) -> None:
    for teacher in ("answers", "kvzip+answers"):
        with pytest.raises(
            ValueError, match=re.escape(f"--teacher {teacher} needs the needles' answers: use --data varied")
        ):
            TrainConfig(model="smollm2", teacher=teacher, **options)


def test_an_answers_teacher_refuses_text_files_before_collecting(tmp_path, tokenizer) -> None:
    from kvevict.gates.train import build

    config = TrainConfig(model="smollm2", teacher="answers", data="phrased")
    with pytest.raises(
        ValueError, match="which text files lack; use --data varied, phrased, phrased-both-orders or phrased-dense$"
    ) as error:
        build(tiny_model(), tokenizer, config, tmp_path, files=[tmp_path / "essay.txt"], progress=False)
    assert "\n" not in str(error.value) and not (tmp_path / "data").exists()


def test_a_context_longer_than_a_repeat_chunk_gives_features_of_its_prefill() -> None:
    """KVzip repeats a long context in chunks of 2,048 tokens: the features are the prefill's, at
    positions past the first chunk too, not a repeat chunk's."""
    model = tiny_model()
    ids = prompt(2200, seed=3)
    positions = torch.tensor([4, 1000, 2100, 2199])
    features, targets = collect(model, ids, positions)
    inputs = {}
    handles = hook_attention_inputs(model, lambda index, hidden, cache: inputs.setdefault(index, hidden[0, positions]))
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    assert torch.equal(features, torch.stack([inputs[i] for i in sorted(inputs)]).half())
    assert targets.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads, 4)


def test_top_positions_are_each_layers_highest_kvzip_scores_past_the_sinks_and_the_drawn() -> None:
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.4, 0.8, 0.0, 0.7, 0.6, 0.5], [0.0] * 9 + [0.95]])
    drawn = torch.tensor([5])
    assert top_positions(scores, drawn, 3).tolist() == [7, 8, 9]  # 9 by its second head; 0 a sink, 5 drawn
    sliding = torch.tensor([[float("nan")] * 6 + [0.1, 0.3, 0.2, 0.0]])
    assert top_positions(sliding, torch.tensor([4]), 2).tolist() == [7, 8]


def test_collecting_top_positions_adds_each_layers_best_scored_tokens_after_the_drawn() -> None:
    """With ``top``, every layer's features and targets gain its own ``top`` best-scored positions
    (the prefill's hidden states there); the drawn positions' data is what ``collect`` gives without."""
    model = tiny_model()
    ids = prompt(96, seed=4)
    positions = torch.arange(4, 96, 8)
    plain = collect(model, ids, positions)
    features, targets = collect(model, ids, positions, top=6)
    m = len(positions)
    assert features.shape[1] == targets.shape[2] == m + 6
    assert torch.equal(features[:, :m], plain[0]) and torch.equal(targets[:, :, :m], plain[1])
    whole = collect(model, ids, torch.arange(96))
    for layer in range(model.config.num_hidden_layers):
        chosen = top_positions(whole[1][layer], positions, 6)
        assert torch.equal(features[layer, m:], whole[0][layer, chosen])
        assert torch.equal(targets[layer, :, m:], whole[1][layer][:, chosen])
        others = torch.ones(96, dtype=torch.bool)
        others[:4], others[positions], others[chosen] = False, False, False
        assert float(targets[layer, :, m:].amax(0).min()) >= float(whole[1][layer][:, others].amax(0).max())


def shipped_run(filename: str) -> dict[str, str]:
    """The training configuration a shipped gates file records (its metadata less what the run measured)."""
    from safetensors import safe_open

    from kvevict.gates import FOLDER

    with safe_open(str(FOLDER / filename), "pt") as shipped:
        metadata = shipped.metadata()
    return {
        key: value
        for key, value in metadata.items()
        if key not in ("model_key", "held_out_loss_initial", "held_out_loss", "held_out_scores")
    }


def test_the_shipped_smollm2_gates_record_their_recipe_and_top_is_recorded_when_used() -> None:
    """SmolLM2's gates are trained with ``--data phrased --teacher answers --count 256 --length 1024,2048
    --listwise 1`` (docs/fastkvzip.md, round 34): their metadata is that command's. ``--top`` is recorded,
    ``--order 0``, ``--listwise 0`` and ``--teacher kvzip`` are not (gates trained before the options hold none)."""
    shipped = {"data": "phrased", "teacher": "answers", "count": 256, "length": (1024, 2048), "listwise": 1.0}
    run = shipped_run("llama-L30-D576-H9-KV3.safetensors")
    assert recorded(TrainConfig(model="smollm2", **shipped)) == run
    assert recorded(TrainConfig(model="smollm2", **shipped | {"order": 0.5})) == run | {"order": "0.5"}
    assert "listwise" not in recorded(TrainConfig(model="smollm2", listwise=0.0))
    assert "order" not in recorded(TrainConfig(model="smollm2", order=0.0))
    assert recorded(TrainConfig(model="smollm2", top=256))["top"] == "256"
    assert "teacher" not in recorded(TrainConfig(model="smollm2", teacher="kvzip"))
    assert recorded(TrainConfig(model="smollm2"))["teacher"] == "kvzip+"


def test_the_shipped_gates_record_how_they_were_judged_on_held_out_families() -> None:
    """Both shipped gates carry their bench scores beside the full cache's (kvevict.gates.judged)."""
    import json

    from safetensors import safe_open

    from kvevict.gates import FOLDER
    from kvevict.gates.judged import KEY

    for name in ("llama-L30-D576-H9-KV3.safetensors", "gemma3_text-L18-D640-H4-KV1.safetensors"):
        with safe_open(str(FOLDER / name), "pt") as shipped:
            judged = json.loads(shipped.metadata()[KEY])
        assert judged["policy"] == "fastkvzip" and {"needles_dialogue", "needles_lists_codes"} <= set(judged["tasks"])
        assert set(judged["share_of_full"]) == {"0.25", "0.1"}


@pytest.mark.parametrize("field", ["data", "teacher"])
def test_an_unknown_data_source_or_teacher_is_refused_in_one_line(field) -> None:
    with pytest.raises(ValueError, match="unknown .*'nope'; use one of") as error:
        TrainConfig(model="smollm2", **{field: "nope"})
    assert "\n" not in str(error.value)


def test_gemmas_shipped_gates_record_smollm2s_recipe() -> None:
    """Gemma-3-270M's gates are trained with SmolLM2's recipe, ``--data phrased --teacher answers --count 256
    --length 1024,2048 --listwise 1`` (docs/fastkvzip.md, round 35): their metadata is that command's."""
    shipped = {"data": "phrased", "teacher": "answers", "count": 256, "length": (1024, 2048), "listwise": 1.0}
    assert recorded(TrainConfig(model="gemma3", **shipped)) == shipped_run("gemma3_text-L18-D640-H4-KV1.safetensors")


def test_a_checkpoint_names_order_only_when_used_so_one_written_before_the_option_resumes() -> None:
    from kvevict.gates.train import _resumable

    assert "order" not in _resumable(TrainConfig(model="smollm2", order=0.0))
    assert _resumable(TrainConfig(model="smollm2", order=1.0))["order"] == 1.0
    assert "teacher" not in _resumable(TrainConfig(model="smollm2", teacher="kvzip"))
    assert _resumable(TrainConfig(model="smollm2"))["teacher"] == "kvzip+"
    assert "listwise" not in _resumable(TrainConfig(model="smollm2"))
    assert _resumable(TrainConfig(model="smollm2", listwise=0.3))["listwise"] == 0.3


def test_two_collecting_processes_write_the_data_and_gates_one_writes_and_resume_past_a_stale_claim(
    tokenizer, tmp_path, monkeypatch, one_thread
) -> None:
    import os
    import time

    from kvevict.gates.train import Collecting, build

    computed = tmp_path / "computed-by"
    compute = Collecting.compute
    first = os.getpid()

    def noted(self, index: int) -> None:
        with computed.open("a") as note:
            note.write(f"{os.getpid()} {index}\n")
        if index == 0 and len(computed.read_text().splitlines()) == 1:  # the first run: wait for the helper's first
            waited = time.monotonic()
            while all(line.startswith(f"{first} ") for line in computed.read_text().splitlines()):
                assert time.monotonic() - waited < 60, "no helper computed a context"
                time.sleep(0.05)
        compute(self, index)

    monkeypatch.setattr(Collecting, "compute", noted)
    model = tiny_model(vocab=len(tokenizer))
    config = TrainConfig(model="tiny", count=6, length=(64,), steps=3, batch=32)
    gates = {
        workers: build(model, tokenizer, config, tmp_path / str(workers), progress=False, workers=workers)
        for workers in (2, 1)
    }
    assert gates[1].read_bytes() == gates[2].read_bytes()
    runs = [line.split() for line in computed.read_text().splitlines()]
    assert sorted(index for _, index in runs) == sorted(2 * [str(index) for index in range(6)])  # each once a run
    assert len({pid for pid, _ in runs[:6]}) == 2  # the first run's contexts: by both processes

    def files(workers: int) -> dict[str, bytes]:
        return {
            path.name: path.read_bytes() for path in (tmp_path / str(workers) / "data").rglob("*") if path.is_file()
        }

    assert files(1) == files(2) and sorted(files(1)) == [f"{index:04d}.safetensors" for index in range(6)]
    (folder,) = (tmp_path / "2" / "data").iterdir()
    (folder / "0004.safetensors").unlink()  # a run interrupted while collecting context 4
    (folder / "0004.claim").touch()
    (folder / ".0004.partial").write_bytes(b"half")
    assert (
        build(model, tokenizer, config, tmp_path / "2", progress=False, workers=2).read_bytes() == gates[1].read_bytes()
    )
    assert files(2) == files(1)  # the stale claim and the partial file are gone


def test_collecting_in_several_processes_refuses_a_multithreaded_parent(tmp_path) -> None:
    """A process forked from one whose thread pool has run can hang in it: the helpers are forked from one thread."""
    from kvevict.gates.train import Collecting

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="one thread per process: call torch.set_num_threads"):
            Collecting(None, [], tmp_path, 0, False, False).start_helpers(1)
    finally:
        torch.set_num_threads(threads)
