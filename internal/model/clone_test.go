package model

import (
	"fmt"
	"reflect"
	"testing"
	"time"
)

// TestVolumeClone fills every field of a Volume, however deep, by
// reflection (a field of a kind the filler does not know fails the test,
// so a new field cannot slip past it), and checks that Clone copies
// everything and shares nothing: no pointer, slice or map of the copy is
// the original's.
func TestVolumeClone(t *testing.T) {
	v := &Volume{}
	n := 0
	fill(t, reflect.ValueOf(v).Elem(), &n, "Volume")
	c := v.Clone()
	if !reflect.DeepEqual(v, c) {
		t.Fatalf("clone differs:\n%+v\n%+v", v, c)
	}
	noAlias(t, reflect.ValueOf(v).Elem(), reflect.ValueOf(c).Elem(), "Volume")
	if got := (&Volume{}).Clone(); !reflect.DeepEqual(got, &Volume{}) {
		t.Fatalf("clone of an empty volume is %+v (nil must stay nil)", got)
	}
	if (*Volume)(nil).Clone() != nil {
		t.Fatal("clone of nil is not nil")
	}
}

var timeType = reflect.TypeOf(time.Time{})

// fill sets every field below v to a value that is not zero.
func fill(t *testing.T, v reflect.Value, n *int, path string) {
	t.Helper()
	*n++
	switch {
	case v.Type() == timeType:
		v.Set(reflect.ValueOf(time.Unix(int64(*n), 0).UTC()))
		return
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(fmt.Sprintf("s%d", *n))
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(int64(*n))
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(uint64(*n))
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fill(t, v.Elem(), n, path)
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 2, 2))
		for i := range 2 {
			fill(t, v.Index(i), n, fmt.Sprintf("%s[%d]", path, i))
		}
	case reflect.Map:
		v.Set(reflect.MakeMap(v.Type()))
		for range 2 {
			k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
			fill(t, k, n, path+".key")
			fill(t, e, n, path+".value")
			v.SetMapIndex(k, e)
		}
	case reflect.Struct:
		for i := range v.NumField() {
			f := v.Type().Field(i)
			if !f.IsExported() {
				t.Fatalf("%s.%s: unexported field; teach the test and Clone about it", path, f.Name)
			}
			fill(t, v.Field(i), n, path+"."+f.Name)
		}
	default:
		t.Fatalf("%s: a field of kind %s; teach the test and Clone about it", path, v.Kind())
	}
}

// noAlias fails when a and b, equal values, share memory anywhere.
func noAlias(t *testing.T, a, b reflect.Value, path string) {
	t.Helper()
	if a.Type() == timeType {
		return
	}
	switch a.Kind() {
	case reflect.Pointer:
		if !a.IsNil() && a.Pointer() == b.Pointer() {
			t.Errorf("%s: the clone shares the pointer", path)
			return
		}
		if !a.IsNil() {
			noAlias(t, a.Elem(), b.Elem(), path)
		}
	case reflect.Slice:
		if a.Len() > 0 && a.Pointer() == b.Pointer() {
			t.Errorf("%s: the clone shares the slice", path)
			return
		}
		for i := range a.Len() {
			noAlias(t, a.Index(i), b.Index(i), fmt.Sprintf("%s[%d]", path, i))
		}
	case reflect.Map:
		if a.Len() > 0 && a.Pointer() == b.Pointer() {
			t.Errorf("%s: the clone shares the map", path)
		}
	case reflect.Struct:
		for i := range a.NumField() {
			noAlias(t, a.Field(i), b.Field(i), path+"."+a.Type().Field(i).Name)
		}
	}
}
