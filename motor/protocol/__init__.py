"""Wire types shared by motor's processes (controller, node manager, coordinator)."""
