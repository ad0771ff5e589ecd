"""The pipeline's user-facing error: raised with a message that names the file, sample or flag.
Scripts print it as one line on stderr and exit non-zero (see `common.cli.run_main`)."""


class PipelineError(Exception):
    """Bad input or an unusable environment, explained to the user in one line."""
