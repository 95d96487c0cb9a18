"""Drop-in replacements for the APIs of other fault-tolerance clients."""
