import pytest

from edurl.llm.loop import group_seed, problem_seed, substeps


def test_substeps_cut_a_batch_into_consecutive_slices():
    assert substeps(list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert substeps(list(range(3)), 1) == [[0, 1, 2]]
    # a batch that does not divide (groups dropped by drop_uniform_groups) still takes num_substeps steps: slices of
    # sizes that differ by at most 1, where ceil-sized slices once gave 12 datums 6 steps instead of 8
    assert substeps(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(c) for c in substeps(list(range(12)), 8)] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert substeps(list(range(3)), 8) == [[0], [1], [2]]  # fewer datums than steps: one each
    assert substeps([], 4) == []


def test_large_seeds_give_seeds_torch_accepts():
    # seed * 100_003 once passed int64 for seeds from about 9.2e7, after the warm start had been trained
    import torch

    for seed in (0, 2**31 - 1, 10**15):
        s = group_seed(problem_seed(seed, 7), 31)
        assert 0 <= s < 2**63
        torch.Generator().manual_seed(s)
    assert group_seed(problem_seed(3, 7), 5) == problem_seed(3, 7) * 100_003 + 5  # the seeds of every run so far


def test_problem_seeds_differ_by_step_and_seed_and_repeat():
    seeds = {problem_seed(s, t) for s in range(3) for t in range(100)}
    assert len(seeds) == 300 and problem_seed(2, 7) == problem_seed(2, 7)


@pytest.mark.parametrize("n", [0, -1])
def test_substeps_needs_a_positive_count(n):
    with pytest.raises(ValueError, match="num_substeps"):
        substeps([1, 2], n)
