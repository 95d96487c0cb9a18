"""The command line: `ftd serve`'s arguments, the admin commands, `ftd top`."""
