// Package mountns builds mounts with the new mount API and attaches them in
// another process's mount namespace.
//
// The sequence is the one systemd's mount_in_namespace uses: a mount is built
// detached in the caller's namespace (fsopen/fsconfig/fsmount for a
// filesystem, open_tree(OPEN_TREE_CLONE) for a bind), so its source, device
// node and path options resolve where the plugin put them; then a goroutine
// locked to its own OS thread enters the consumer's namespace with setns and
// attaches the mount with move_mount. Nothing of the mount ever appears in the
// caller's namespace.
//
// Linux only.
package mountns
