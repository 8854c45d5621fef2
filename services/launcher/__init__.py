"""Starting processes: the `splitserve` command, the local launcher and the supervisor of `splitserve up`."""
