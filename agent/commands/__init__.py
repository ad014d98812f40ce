"""Click commands and their rendering, one module per subcommand; the probes they drive live in
`aiprobe.<probe>`, which never import click."""
