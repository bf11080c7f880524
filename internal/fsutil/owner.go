package fsutil

import "os"

// The plugin runs as root without a capability: it passes a permission
// check only as an owner (uid 0) or through the group (gid 0). What the
// mounter makes in the plugin's state dir that the plugin must not change
// therefore belongs to another user, MounterUID:
//
//   - the state dir itself, sticky and writable by the group (StateDirMode):
//     the plugin adds its entries, but renames or removes only its own, so
//     it cannot swap a directory of the mounter's for a symlink;
//   - <state-dir>/fuse and each volume's directory in it, whose paths the
//     FUSE daemons are given as strings: the plugin can create, rename or
//     plant nothing there;
//   - <state-dir>/nri, the NRI guard's directory.
//
// The mounter and a plugin that runs its own (both privileged) pass any
// permission check. No user of the node should have this uid.
const (
	MounterUID = 65533
	MounterGID = 65533
)

// StateDirMode is the state dir's mode once the mounter owns it: sticky,
// the plugin's group may add entries, others (a FUSE daemon of another
// user) only traverse.
const StateDirMode = os.ModeDir | os.ModeSticky | 0o771
