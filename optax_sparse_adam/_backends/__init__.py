"""How a step runs on each backend. Private."""
