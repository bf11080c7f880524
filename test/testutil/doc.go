// Package testutil holds the helpers that mountplan's root tests share: a
// leak checker over loop devices, mounts, FUSE connections and processes;
// mount namespaces from unshare(1); a private containerd that runs busybox
// containers with `ctr run --rootfs`; building the project's binaries once
// per test binary; and starting the plugin on a temporary socket.
//
// Cleanup order matters. t.Cleanup runs functions last-registered-first, so
// a root test calls NoLeaks first: its check then runs after every other
// cleanup (containers, containerd, plugin, unshare namespaces) has finished.
//
//	func TestSomething(t *testing.T) {
//		testutil.RequireRoot(t)
//		testutil.NoLeaks(t)
//		ctrd := testutil.StartContainerd(t)
//		c := ctrd.Run(t, "c1", testutil.BusyboxRootfs(t), "sleep", "3600")
//		...
//	}
//
// Helpers that start long-lived processes put their sockets in short
// directories under os.TempDir() (a unix socket path must fit in 108 bytes,
// and t.TempDir() embeds the test's name) and register those directories as
// leak markers, so the leak checker also tracks processes that are not
// descendants of the test process, such as containerd's shims.
//
// nsenter(1) is used here, in tests only, to look inside a namespace; the
// product itself must never rely on it.
package testutil
