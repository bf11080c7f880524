// Package fdlimit sizes the plugin's budget of open files (RLIMIT_NOFILE).
//
// The mounter (the sidecar's, or the plugin's own when it runs one in
// process) holds one file descriptor per staged loop volume for as long
// as it is staged: with autoclear, that fd is what keeps an unmounted
// device bound, and what lets the kernel detach it when the mounter dies
// (see internal/loopdev). A container runtime's default limit (often 1,024 soft,
// sometimes 1,024 hard as well) would cap a node at about a thousand
// staged volumes. Go raises the soft limit to the hard one at start;
// Raise lifts the hard limit as well where the process may
// (CAP_SYS_RESOURCE, which the mounter's privileged container has).
package fdlimit

// Want is the budget the plugin asks for: the kernel's default fs.nr_open,
// room for a million staged volumes. The kernel charges nothing for a
// limit that is not used.
const Want = 1 << 20
