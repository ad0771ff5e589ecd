"""The pipeline's user-facing error: raised with a message that names the file, sample or flag.
Scripts print it as one line on stderr and exit non-zero (see `common.cli.run_main`)."""


# A long run skips and counts bad samples; past 1% of them (at least 10) the damage is systematic
# and the run stops with the list (02's extraction, 04's damaged files and online rows alike).
MAX_SKIPPED_SHARE, MIN_SKIPPED_LIMIT = 0.01, 10


class PipelineError(Exception):
    """Bad input or an unusable environment, explained to the user in one line."""


def skip_limit(total: int) -> int:
    """How many of `total` samples a run may skip before it stops."""
    return max(MIN_SKIPPED_LIMIT, int(MAX_SKIPPED_SHARE * total))


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, for one-line reports of an exception (no imports here:
    vLLM's worker uses it in its own environment)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
