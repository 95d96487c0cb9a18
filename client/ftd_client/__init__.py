"""ftd_client: what runs inside a rank. Standard library only, cheap to import."""

__version__ = "0.1.0"
