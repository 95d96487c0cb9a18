"""What the node is doing: the status model, its one writer (the board), events, persistence."""
