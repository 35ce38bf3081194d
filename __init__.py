"""Not the package: the normsurgery repository, which Python imports as ``normsurgery`` when it
runs from the folder holding a clone of that name (the current folder comes first on ``sys.path``;
without this file it would be an empty namespace package, ahead of an editable install's finder,
and ``normsurgery.verify`` an AttributeError). The package is the ``normsurgery/`` folder inside.
Imported under another name (pytest collects this folder as a package), it does nothing."""

if __name__ == "normsurgery":
    raise ImportError(f"Python imported the normsurgery repository ({__path__[0]}) instead of the package inside "
                      "it, because it runs from the folder holding the clone: run it from any other folder")
