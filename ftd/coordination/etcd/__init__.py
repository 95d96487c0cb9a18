"""The etcd rendezvous backend (and its client, client/)."""
