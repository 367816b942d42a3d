import pytest

from edurl.llm.loop import problem_seed, substeps


def test_substeps_cut_a_batch_into_consecutive_slices():
    assert substeps(list(range(8)), 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert substeps(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]  # the last may be shorter
    assert substeps(list(range(3)), 1) == [[0, 1, 2]]


def test_problem_seeds_differ_by_step_and_seed_and_repeat():
    seeds = {problem_seed(s, t) for s in range(3) for t in range(100)}
    assert len(seeds) == 300 and problem_seed(2, 7) == problem_seed(2, 7)


@pytest.mark.parametrize("n", [0, -1])
def test_substeps_needs_a_positive_count(n):
    with pytest.raises(ValueError, match="num_substeps"):
        substeps([1, 2], n)
