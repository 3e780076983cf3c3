package limits

// Reason codes of tokenbroker_limited_total and of the audit.
const (
	ReasonIssuanceRate  = "issuance_rate"
	ReasonRenewalRate   = "renewal_rate"
	ReasonEnrollRate    = "enrollment_rate"
	ReasonLiveLeases    = "max_live_leases"
	ReasonLiveLeasesAll = "global_max_live_leases"
	ReasonLeaseReadRate = "lease_read_rate"
	ReasonLeaseReads    = "lease_reads_in_flight"
)
