package volview

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Proc reads mount tables and mount namespace identities under Root, a
// /proc. It only reads.
type Proc struct {
	// Root is the proc filesystem: "/proc", or a fake tree in tests
	// (<pid>/mountinfo, <pid>/ns/mnt a symlink to "mnt:[<inode>]",
	// self/mountinfo).
	Root string
	// DeviceAt returns the device ("major:minor") of the block device node
	// at path on the node, "" when path is something else; nil: lstat(2)
	// (tests fake it).
	DeviceAt func(path string) (string, error)
}

// HostProc reads the /proc this process sees.
var HostProc = Proc{Root: "/proc"}

// Check sets the Kernel field of every consumer in r: a kubelet target is
// looked up in the node's mount table as this process sees it
// (self/mountinfo), a container's mount point in the mount table of a
// process in the recorded mount namespace (the recorded PID if it is
// still in it, else any process that is).
func (p Proc) Check(r *Report) {
	self := p.lazyTable("self")
	for i := range r.Volumes {
		for j := range r.Volumes[i].Consumers {
			c := &r.Volumes[i].Consumers[j]
			switch {
			case c.Kind == KindContainer:
				c.Kernel = p.checkContainer(*c)
			case c.DeviceNode != "":
				c.Kernel = p.checkDeviceNode(*c)
			default:
				table, err := self()
				c.Kernel = judge(table, err, c.Path, "self")
			}
		}
	}
}

// lazyTable reads pid's mount table once, when first asked.
func (p Proc) lazyTable(pid string) func() (map[string]bool, error) {
	var (
		done  bool
		table map[string]bool
		err   error
	)
	return func() (map[string]bool, error) {
		if !done {
			table, err = p.mountPoints(pid)
			done = true
		}
		return table, err
	}
}

func judge(table map[string]bool, err error, path, via string) Kernel {
	if err != nil {
		return Kernel{State: Unknown, Via: via, Detail: err.Error()}
	}
	if table[filepath.Clean(path)] {
		return Kernel{State: Present, Via: via}
	}
	return absent(via, "recorded as mounted; the mount table shows nothing there")
}

// absent is the kernel's answer where the records name a mount (or device
// node) it does not show: the one state in which the two disagree.
func absent(via, detail string) Kernel {
	return Kernel{State: Absent, Disagrees: true, Via: via, Detail: detail}
}

func (p Proc) checkContainer(c Consumer) Kernel {
	pid, err := p.processIn(c)
	if err != nil {
		return Kernel{State: Unknown, Detail: err.Error()}
	}
	via := strconv.Itoa(pid)
	table, err := p.mountPoints(via)
	return judge(table, err, c.Path, "pid "+via)
}

// checkDeviceNode looks for the block device node c records at its path.
func (p Proc) checkDeviceNode(c Consumer) Kernel {
	at := p.DeviceAt
	if at == nil {
		at = blockDeviceAt
	}
	dev, err := at(c.Path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return absent("lstat", "recorded device node "+c.DeviceNode+" is not at "+c.Path)
	case err != nil:
		return Kernel{State: Unknown, Via: "lstat", Detail: err.Error()}
	case dev == "":
		return absent("lstat", c.Path+" is not a block device node (recorded "+c.DeviceNode+")")
	case dev != c.DeviceNode:
		return absent("lstat", fmt.Sprintf("%s is device %s, recorded %s", c.Path, dev, c.DeviceNode))
	}
	return Kernel{State: Present, Via: "lstat"}
}

// blockDeviceAt returns the device of the block device node at path, ""
// when path is something else.
func blockDeviceAt(path string) (string, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return "", &fs.PathError{Op: "lstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return "", nil
	}
	rdev := uint64(st.Rdev) //nolint:unconvert // Rdev is uint32 on some architectures
	return fmt.Sprintf("%d:%d", unix.Major(rdev), unix.Minor(rdev)), nil
}

// processIn finds a process in c's mount namespace: c.PID when it is
// still there (or when no namespace was recorded), else any process whose
// namespace is the recorded one.
func (p Proc) processIn(c Consumer) (int, error) {
	if c.PID > 0 {
		ns, err := p.mountNS(strconv.Itoa(c.PID))
		switch {
		case err == nil && (c.MountNS == 0 || ns == c.MountNS):
			return c.PID, nil
		case err != nil && !errors.Is(err, fs.ErrNotExist):
			return 0, err
		}
	}
	if c.MountNS == 0 {
		if c.PID == 0 {
			return 0, errors.New("no process recorded yet (the container has not started)")
		}
		return 0, fmt.Errorf("process %d is gone and its mount namespace was not recorded", c.PID)
	}
	ents, err := os.ReadDir(p.Root)
	if err != nil {
		return 0, err
	}
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		if ns, err := p.mountNS(e.Name()); err == nil && ns == c.MountNS {
			pid, _ := strconv.Atoi(e.Name())
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no process in mount namespace %d is visible from here (gone, or this process lacks the host's PID namespace)", c.MountNS)
}

// mountNS returns the inode of pid's mount namespace.
func (p Proc) mountNS(pid string) (uint64, error) {
	link, err := os.Readlink(filepath.Join(p.Root, pid, "ns", "mnt"))
	if err != nil {
		return 0, err
	}
	s, ok := strings.CutPrefix(link, "mnt:[")
	s, ok2 := strings.CutSuffix(s, "]")
	if !ok || !ok2 {
		return 0, fmt.Errorf("%s/%s/ns/mnt: unexpected link %q", p.Root, pid, link)
	}
	return strconv.ParseUint(s, 10, 64)
}

// mountPoints returns the mount points of pid's mount table.
func (p Proc) mountPoints(pid string) (map[string]bool, error) {
	f, err := os.Open(filepath.Join(p.Root, pid, "mountinfo"))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ParseMountPoints(f)
}

// ParseMountPoints reads a mountinfo table (proc_pid_mountinfo(5)) and
// returns its mount points, unescaped.
func ParseMountPoints(r io.Reader) (map[string]bool, error) {
	out := map[string]bool{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			return nil, fmt.Errorf("mountinfo: malformed line %q", sc.Text())
		}
		out[unescape(fields[4])] = true
	}
	return out, sc.Err()
}

// unescape undoes the kernel's octal escapes (\040 for a space, \011,
// \012, \134) in a mountinfo path.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
