"""Use cases wired over the store. Entry points (CLI, HTTP, service) call only these."""
