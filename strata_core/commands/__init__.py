"""One module per `strata` sub-command; each has `register(subparsers)`."""
