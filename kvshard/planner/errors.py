"""The one error type of the planner: a mistake in the user's input."""


class PlanError(ValueError):
    """Input the user can fix; the message says what to change. The CLI prints it
    on one line and exits with code 2."""
