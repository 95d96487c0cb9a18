"""What the daemon is told: its configuration, the fault-tolerance parameters, the scheduler's
variables, secrets."""
