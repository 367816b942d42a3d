from edurl.exercises._core import FAILED


def assert_rejected(check, buggy, hint: str):
    """``check`` must fail ``buggy`` and say ``hint`` in its message; returns the verdict for further asserts."""
    verdict = check(buggy, verbose=False)
    assert verdict.status == FAILED, f"{getattr(check, '__name__', check)} accepted a buggy implementation"
    assert hint in verdict.message, f"expected {hint!r} in the checker's message, got: {verdict.message}"
    return verdict
