import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before the CLI's own handler is in place
    sys.stderr.write("error: interrupted: nothing was written\n")
    sys.exit(130)

main()
