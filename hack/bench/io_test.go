package main

import "testing"

func TestParseSize(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"256M", 256 << 20, true},
		{"1G", 1 << 30, true},
		{"64K", 64 << 10, true},
		{"4096", 4096, true},
		{"", 0, false},
		{"-1M", 0, false},
		{"1T", 0, false},
	} {
		got, err := parseSize(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d, ok %v", c.in, got, err, c.want, c.ok)
		}
	}
}

// A job of fio 3.33's JSON, cut to what parseFio reads, after a note fio
// prints before it.
const fioSample = `note: both iodepth >= 1 and synchronous I/O engine are selected
{"jobs": [{"error": 0, "usr_cpu": 10.0, "sys_cpu": 30.0,
  "read": {"total_ios": 2000, "bw_bytes": 4096000, "iops": 1000.0, "runtime": 2000,
    "clat_ns": {"percentile": {"50.000000": 56448, "99.000000": 109824}}},
  "write": {"total_ios": 0, "bw_bytes": 0, "iops": 0, "runtime": 0, "clat_ns": {}}}]}`

func TestParseFio(t *testing.T) {
	f, err := parseFio([]byte(fioSample), false)
	if err != nil {
		t.Fatal(err)
	}
	want := fioFigures{IOs: 2000, Seconds: 2, IOPS: 1000, MBps: 4.096, P50us: 56.448, P99us: 109.824, FioCPUus: 400}
	if f != want {
		t.Errorf("parseFio = %+v, want %+v", f, want)
	}
	// The write side did nothing: an error, not a row of zeros.
	if _, err := parseFio([]byte(fioSample), true); err == nil {
		t.Error("parseFio of a job without writes, asked for writes: no error")
	}
}
