package volview

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// fakeProc makes a /proc tree: self's mount table, and per PID a mount
// namespace and a mount table.
func fakeProc(t *testing.T, self []string, procs map[string]struct {
	ns     string
	points []string
}) Proc {
	t.Helper()
	root := t.TempDir()
	write := func(pid string, points []string) {
		var b strings.Builder
		for i, p := range points {
			// the layout of proc_pid_mountinfo(5): the mount point is field 5
			b.WriteString(strings.Join([]string{"1" + string(rune('0'+i)), "1", "7:3", "/", p, "rw,relatime", "shared:1", "-", "ext4", "/dev/loop3", "rw"}, " ") + "\n")
		}
		if err := os.MkdirAll(filepath.Join(root, pid, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, pid, "mountinfo"), []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("self", self)
	for pid, p := range procs {
		write(pid, p.points)
		if err := os.Symlink("mnt:["+p.ns+"]", filepath.Join(root, pid, "ns", "mnt")); err != nil {
			t.Fatal(err)
		}
	}
	return Proc{Root: root}
}

func TestParseMountPointsUnescapes(t *testing.T) {
	in := "22 1 0:21 / / rw - ext4 /dev/sda1 rw\n" +
		`36 22 7:3 / /var/lib/kubelet/pods/a\040b/mount rw - ext4 /dev/loop3 rw` + "\n" +
		`37 22 7:3 / /odd\134name\011x rw - ext4 /dev/loop3 rw` + "\n"
	got, err := ParseMountPoints(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"/": true, "/var/lib/kubelet/pods/a b/mount": true, "/odd\\name\tx": true}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if _, err := ParseMountPoints(strings.NewReader("garbage\n")); err == nil {
		t.Fatal("a malformed line was accepted")
	}
}

func TestCheckAgainstKernel(t *testing.T) {
	type proc = struct {
		ns     string
		points []string
	}
	p := fakeProc(t, []string{"/", "/var/lib/kubelet/pods/a/volumes/v/mount"}, map[string]proc{
		"100": {ns: "555", points: []string{"/", "/data"}},
		"200": {ns: "777", points: []string{"/"}},
		"300": {ns: "888", points: []string{"/", "/data"}},
	})
	r := &Report{Volumes: []Volume{{ID: "v", Consumers: []Consumer{
		{Kind: KindPublish, Path: "/var/lib/kubelet/pods/a/volumes/v/mount/"},
		{Kind: KindPublish, Path: "/var/lib/kubelet/pods/b/volumes/v/mount"},
		{Kind: KindContainer, Path: "/data", PID: 100, MountNS: 555},
		{Kind: KindContainer, Path: "/data", PID: 999, MountNS: 555}, // gone; 100 is in its namespace
		{Kind: KindContainer, Path: "/data", PID: 200, MountNS: 777},
		{Kind: KindContainer, Path: "/data", PID: 300, MountNS: 999}, // PID reused elsewhere, nobody in 999
		{Kind: KindContainer, Path: "/data", ContainerID: "c1"},      // NRI, not started
		{Kind: KindContainer, Path: "/data", PID: 300},               // no namespace recorded: the PID is trusted
	}}}}
	p.DeviceAt = func(path string) (string, error) {
		switch path {
		case "/k/dev-right", "/k/dev-wrong":
			return "7:3", nil
		case "/k/not-a-device":
			return "", nil
		}
		return "", fs.ErrNotExist
	}
	r.Volumes[0].Consumers = append(r.Volumes[0].Consumers,
		Consumer{Kind: KindNRIPublish, Path: "/k/dev-right", DeviceNode: "7:3"},
		Consumer{Kind: KindNRIPublish, Path: "/k/dev-wrong", DeviceNode: "7:4"},
		Consumer{Kind: KindNRIPublish, Path: "/k/not-a-device", DeviceNode: "7:3"},
		Consumer{Kind: KindNRIPublish, Path: "/k/gone", DeviceNode: "7:3"},
	)
	p.Check(r)
	want := []Kernel{
		{State: Present, Via: "self"},
		{State: Absent, Disagrees: true, Via: "self"},
		{State: Present, Via: "pid 100"},
		{State: Present, Via: "pid 100"},
		{State: Absent, Disagrees: true, Via: "pid 200"},
		{State: Unknown},
		{State: Unknown},
		{State: Present, Via: "pid 300"},
		{State: Present, Via: "lstat"},
		{State: Absent, Disagrees: true, Via: "lstat"},
		{State: Absent, Disagrees: true, Via: "lstat"},
		{State: Absent, Disagrees: true, Via: "lstat"},
	}
	for i, c := range r.Volumes[0].Consumers {
		got := c.Kernel
		got.Detail = ""
		if got != want[i] {
			t.Errorf("consumer %d (%+v): kernel %+v, want %+v", i, c, c.Kernel, want[i])
		}
		if (got.State == Unknown || got.State == Absent) && c.Kernel.Detail == "" {
			t.Errorf("consumer %d: %s without a reason", i, got.State)
		}
	}
	if n := r.Disagreements(); n != 5 {
		t.Errorf("Disagreements = %d, want 5", n)
	}
}

// TestCheckRealProc: this process, found by its PID or by its mount
// namespace alone, has a mount at / (reading /proc only).
func TestCheckRealProc(t *testing.T) {
	ns, err := HostProc.mountNS("self")
	if err != nil {
		t.Skipf("no /proc here: %v", err)
	}
	r := &Report{Volumes: []Volume{{ID: "v", Consumers: []Consumer{
		{Kind: KindContainer, Path: "/", PID: os.Getpid(), MountNS: ns},
		{Kind: KindContainer, Path: "/", PID: 1 << 30, MountNS: ns},
		{Kind: KindPublish, Path: "/"},
		{Kind: KindNRIPublish, Path: t.TempDir(), DeviceNode: "7:0"},
	}}}}
	HostProc.Check(r)
	for i, c := range r.Volumes[0].Consumers[:3] {
		if c.Kernel.State != Present {
			t.Errorf("consumer %d: %+v, want present", i, c.Kernel)
		}
	}
	if k := r.Volumes[0].Consumers[3].Kernel; k.State != Absent || !k.Disagrees {
		t.Errorf("a directory where a device node is recorded: %+v, want absent", k)
	}
}

func TestCheckWithoutProc(t *testing.T) {
	r := &Report{Volumes: []Volume{{ID: "v", Consumers: []Consumer{{Kind: KindPublish, Path: "/x"}}}}}
	Proc{Root: filepath.Join(t.TempDir(), "none")}.Check(r)
	if k := r.Volumes[0].Consumers[0].Kernel; k.State != Unknown || k.Disagrees || k.Detail == "" {
		t.Fatalf("unreadable mount table: %+v, want unknown with a reason and no disagreement", k)
	}
}

func sample() *Report {
	return &Report{Node: "n1", Volumes: []Volume{
		{ID: "pvc-1", Type: "loop", Source: "image /img/pvc-1.img", Device: "/dev/loop3", Stage: "staged",
			Health: Health{Status: "ok"}, Consumers: []Consumer{
				{Kind: KindPublish, Path: "/var/lib/kubelet/pods/a/mount", Kernel: Kernel{State: Present, Via: "self"},
					Pod: &Pod{Namespace: "shop", Name: "web-0", UID: "a"}},
				{Kind: KindNRIPublish, Path: "/var/lib/kubelet/pods/b/mount", Kernel: Kernel{State: Present, Via: "self"}, Pod: &Pod{UID: "b"}},
				{Kind: KindContainer, Path: "/data", ReadOnly: true, PID: 42, MountNS: 4026532000, ContainerID: "0123456789abcdef0123",
					Pod:    &Pod{Namespace: "shop", Name: "web-0", UID: "a", Container: "app"},
					Kernel: Kernel{State: Absent, Disagrees: true, Detail: "recorded as mounted; the mount table shows nothing there"}},
			}},
		{ID: "f", Type: "fuse", Source: "fuse profile s3", DaemonPID: 77, Stage: "staged",
			Health: Health{Status: "INACCESSIBLE", Reason: "DaemonDown"}},
		{ID: "u", Type: "loop", Stage: "unstaged", Health: Health{Status: "-"}},
	}}
}

func TestWriteTable(t *testing.T) {
	var b bytes.Buffer
	if err := WriteTable(&b, sample()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	want := [][]string{
		{"VOLUME", "TYPE", "STAGE", "HEALTH", "DEVICE", "SOURCE"},
		{"pvc-1", "loop", "staged", "ok", "/dev/loop3", "image /img/pvc-1.img"},
		{"publish", "rw", "present", "/var/lib/kubelet/pods/a/mount in pod shop/web-0"},
		{"nri-publish", "rw", "present", "/var/lib/kubelet/pods/b/mount in pod uid b"},
		{"container", "ro", "absent DISAGREES", "/data in pod shop/web-0/app container 0123456789abc pid 42 mntns 4026532000: recorded as mounted"},
		{"f", "fuse", "staged", "INACCESSIBLE DaemonDown", "-", "fuse profile s3 (daemon pid 77)"},
		{"u", "loop", "unstaged", "-", "-", "-"},
		{"1 consumer(s): records and kernel disagree"},
	}
	if len(lines) != len(want) {
		t.Fatalf("%d lines, want %d:\n%s", len(lines), len(want), b.String())
	}
	for i, parts := range want {
		rest := lines[i]
		for _, p := range parts {
			j := strings.Index(rest, p)
			if j < 0 {
				t.Errorf("line %d %q lacks %q (in order)", i, lines[i], p)
				break
			}
			rest = rest[j+len(p):]
		}
	}
	if !strings.HasPrefix(lines[2], "  ") {
		t.Errorf("a consumer line is not indented under its volume: %q", lines[2])
	}
	b.Reset()
	if err := WriteTable(&b, &Report{}); err != nil || b.String() != "VOLUME  TYPE  STAGE  HEALTH  DEVICE  SOURCE\nno volumes\n" {
		t.Errorf("empty listing: %q, %v", b.String(), err)
	}
}

func TestWriteJSONRoundTrip(t *testing.T) {
	var b bytes.Buffer
	if err := WriteJSON(&b, sample()); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(b.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(&back, sample()) {
		t.Fatalf("round trip:\n%+v\n%+v", &back, sample())
	}
	for _, key := range []string{`"disagrees": true`, `"mountNS": 4026532000`, `"daemonPID": 77`, `"readOnly": true`,
		`"container": "app"`, `"name": "web-0"`, `"uid": "b"`} {
		if !strings.Contains(b.String(), key) {
			t.Errorf("JSON lacks %s", key)
		}
	}
}

func TestPodString(t *testing.T) {
	for _, tc := range []struct {
		pod  Pod
		want string
	}{
		{Pod{Namespace: "shop", Name: "web-0", UID: "u", Container: "app"}, "shop/web-0/app"},
		{Pod{Namespace: "shop", Name: "web-0", UID: "u"}, "shop/web-0"},
		{Pod{UID: "u"}, "uid u"},
		{Pod{UID: "u", Container: "app"}, "uid u/app"},
		{Pod{}, ""},
	} {
		if got := tc.pod.String(); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.pod, got, tc.want)
		}
	}
}

func TestPodUIDOfTarget(t *testing.T) {
	const k = "/var/lib/kubelet"
	for target, want := range map[string]string{
		k + "/pods/7d1e-42/volumes/kubernetes.io~csi/pvc-1/mount":                  "7d1e-42",
		k + "/pods/7d1e-42/volumes/kubernetes.io~csi/pvc-1/mount/":                 "7d1e-42",
		k + "/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/7d1e-42":       "7d1e-42",
		k + "/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-1/7d1e-42/extra": "",
		k + "/plugins/kubernetes.io/csi/volumeDevices/staging/pvc-1/7d1e-42":       "",
		k + "/pods/7d1e-42/plugins/x":                                              "",
		"/elsewhere/pods/7d1e-42/volumes/kubernetes.io~csi/pvc-1/mount":            "",
		k + "/../pods/7d1e-42/volumes/x/mount":                                     "",
	} {
		if got := PodUIDOfTarget(k, target); got != want {
			t.Errorf("%s: %q, want %q", target, got, want)
		}
	}
}
