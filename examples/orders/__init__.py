"""An order service whose unpaid orders close themselves (see README.md here)."""
