package ctl

import "testing"

// TestCommands: the command table agrees with the numbers: each size is the
// one encoded in the number, numbers and names are unique, and the
// ioctl type is gdsfs's.
func TestCommands(t *testing.T) {
	nums, names := map[uint32]bool{}, map[string]bool{}
	for _, c := range Commands() {
		if CmdSize(c.Cmd) != c.Size || !OurCmd(c.Cmd) || c.Cmd>>30 != 3 {
			t.Errorf("%s: number %#x encodes size %d (want %d), type %q, dir %d", c.Name, c.Cmd, CmdSize(c.Cmd), c.Size, rune(c.Cmd>>8&0xff), c.Cmd>>30)
		}
		if nums[c.Cmd] || names[c.Name] {
			t.Errorf("%s (%#x) listed twice", c.Name, c.Cmd)
		}
		nums[c.Cmd], names[c.Name] = true, true
		if got := CommandName(c.Cmd); got != c.Name {
			t.Errorf("CommandName(%#x) = %q, want %q", c.Cmd, got, c.Name)
		}
	}
	if len(nums) != 10 {
		t.Errorf("%d commands, docs/protocol.md defines 10", len(nums))
	}
	if got := CommandName(0x5401); got != "" { // TCGETS
		t.Errorf("CommandName(TCGETS) = %q, want none", got)
	}
}
