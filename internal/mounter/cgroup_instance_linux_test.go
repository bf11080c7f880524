//go:build linux

package mounter

import "testing"

// TestRecordedInstance: the instance is read back from a live daemon's
// recorded leaf, v2 (…/daemons/<volume>) and v1 alike, and only from a
// leaf of its volume below the host's cgroups.
func TestRecordedInstance(t *testing.T) {
	const fs = "/host/sys/fs/cgroup"
	for _, tt := range []struct {
		name   string
		leaves map[string]string
		want   string
	}{
		{"none", nil, ""},
		{"v2", map[string]string{"vol": fs + "/mountplan-daemons/abc/daemons/vol"}, "abc"},
		{"hybrid unified", map[string]string{"vol": fs + "/unified/mountplan-daemons/abc/daemons/vol"}, "abc"},
		{"v1", map[string]string{"vol": fs + "/memory/mountplan-daemons/def/vol"}, "def"},
		{"first in volume order", map[string]string{"b": fs + "/mountplan-daemons/two/daemons/b", "a": fs + "/mountplan-daemons/one/daemons/a"}, "one"},
		{"not below the host's cgroups", map[string]string{"vol": "/sys/fs/cgroup/mountplan-daemons/abc/daemons/vol"}, ""},
		{"another volume's leaf", map[string]string{"vol": fs + "/mountplan-daemons/abc/daemons/other"}, ""},
		{"below the mounter's cgroup", map[string]string{"vol": fs + "/kubepods/pod1/daemons/vol"}, ""},
	} {
		if got := recordedInstance(fs, tt.leaves); got != tt.want {
			t.Errorf("%s: recordedInstance = %q, want %q", tt.name, got, tt.want)
		}
	}
}
