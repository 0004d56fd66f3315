from kvevict.bench.longgen import NEW_TOKENS, TOPICS, TOPICS_PER_SEED, LongGeneration


def topics(tokenizer, seed: int, count: int = TOPICS_PER_SEED) -> list[str]:
    return [s.context for s in LongGeneration().samples(tokenizer, length=0, count=count, seed=seed)]


def test_seeds_draw_disjoint_topic_sets_so_tuning_can_be_held_out(tokenizer) -> None:
    sets = [set(topics(tokenizer, seed)) for seed in range(len(TOPICS) // TOPICS_PER_SEED)]
    assert all(len(s) == TOPICS_PER_SEED for s in sets)
    assert len(set.union(*sets)) == len(TOPICS)  # pairwise disjoint, every topic used
    assert set(topics(tokenizer, 3)) == sets[0]  # seeds cycle over the sets


def test_samples_are_deterministic_and_capped_at_a_seeds_topics(tokenizer) -> None:
    assert topics(tokenizer, 1) == topics(tokenizer, 1)
    samples = LongGeneration().samples(tokenizer, length=0, count=20, seed=0)
    assert len(samples) == TOPICS_PER_SEED
    assert {s.max_new_tokens for s in samples} == {NEW_TOKENS}
    assert len({s.context_id for s in samples}) == TOPICS_PER_SEED
