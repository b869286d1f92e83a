"""Prints the default StorageClass manifest of kind's node image (the local-path provisioner) with the images built
here in place of kind's: kind writes it into its node image from a Go constant (pkg/build/nodeimage/
const_storage.go), which is read from the pinned kind module rather than copied into this repository.

    python3 storage_manifest.py CONST_STORAGE_GO PROVISIONER_IMAGE HELPER_IMAGE
"""

import re
import sys


def manifest(go_source: str, provisioner: str, helper: str) -> str:
    """The constant defaultStorageManifest, its `+ name +` joins resolved to the images given."""
    images = {"storageProvisionerImage": provisioner, "storageHelperImage": helper}
    body = re.search(r"const defaultStorageManifest = ((?:`[^`]*`|\s*\+\s*\w+\s*\+\s*)+)", go_source)
    if body is None:
        raise SystemExit("storage_manifest: no defaultStorageManifest constant in that file")
    parts = re.findall(r"`([^`]*)`|(\w+)", body.group(1))
    unknown = [name for _, name in parts if name and name not in images]
    if unknown:
        raise SystemExit(f"storage_manifest: the manifest joins names this script does not know: {unknown}")
    return "".join(text or images[name] for text, name in parts)


if __name__ == "__main__":
    source, provisioner_image, helper_image = sys.argv[1:4]
    with open(source, encoding="utf-8") as f:
        sys.stdout.write(manifest(f.read(), provisioner_image, helper_image))
